"""Hand-worked eviction examples, budget rules, and conformance tests that run for every registered policy."""
import math
from dataclasses import dataclass

import pytest
import torch

from h2o_mini import (H2O, REGISTRY, TOVA, Full, HeavyHitter, KeyDiff, KNorm, Local, PyramidKV, Scissorhands, Sinks,
                      SnapKV, UserError, make_policy)
from h2o_mini.cache import KVCache
from h2o_mini import prompt
from h2o_mini.config import Config
from h2o_mini.policies import Policy, capacity_for, parse_budget
from h2o_mini.policies.guard import PolicyFault, checked

from .conftest import GPL3, text_bytes
from .test_bad_input import one_line_error, run_cli

# One layer, one KV head shared by two query heads (GQA group of 2), head_dim 4.
CFG = Config(family="llama", vocab_size=8, n_layer=1, n_head=2, n_kv_head=1, d_model=8, head_dim=4, d_ff=8,
             max_seq_len=64)


def read_one(lc, q, k, v, pos, mode):
    """One token into a layer: its decode step, or (mode "stream") the stream loop over a chunk of one."""
    if mode == "stream":
        return prompt.stream(lc, q, lc.codec.encode(k), lc.codec.encode(v), pos)
    return lc.attend(q, k, v, pos)


def uniform_steps(policy, n, mode):
    """Feed n tokens with q = 0 (uniform attention over the cache); returns the sorted cached positions and
    the scores after every step."""
    cache = KVCache(CFG, policy, 1, policy.capacity or n)
    seen = []
    for t in range(n):
        q, k, v = torch.zeros(1, 2, 1, 4), torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4)
        read_one(cache.layers[0], q, k, v, torch.tensor([[t]]), mode)
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
    read_one(lc, torch.zeros(1, 2, 1, 4), torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), torch.tensor([[8]]), mode)
    assert sorted(lc.pos[0, 0].tolist()) == [5, 7, 8]


def test_dense_ties_keep_the_newest():
    cache = KVCache(CFG, HeavyHitter(heavy=2), 1, 2)
    q = torch.zeros(1, 2, 4, 4)  # uniform causal attention over 4 prompt tokens
    cache.layers[0].attend(q, torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4), torch.arange(4)[None])
    # s = 2 * (1 + 1/2 + 1/3 + 1/4, 1/2 + 1/3 + 1/4, 1/3 + 1/4, 1/4): keep 0 and 1
    assert cache.layers[0].pos[0, 0].tolist() == [0, 1]
    cache = KVCache(CFG, Local(recent=2), 1, 2)
    cache.layers[0].attend(q, torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4), torch.arange(4)[None])
    assert cache.layers[0].pos[0, 0].tolist() == [2, 3]


# ---- conformance: parametrized over the registry, so a new policy is tested the moment it is registered ----

def _conformance_run(model, policy, ids):
    cache = KVCache(model.cfg, policy, 1, len(ids))
    evicted, logits = set(), []
    for t, tok in enumerate(ids):
        before = []
        for lc in cache.layers:
            keep = policy.keep_score(lc.score, lc.pos, torch.tensor(t), lc.keys(), lc.values())
            keep = keep.masked_fill(lc.pos < 0, -torch.inf)
            before.append((lc.pos.clone(), lc.pos[keep == torch.inf].tolist()))
        logits.append(model(torch.tensor([[tok]]), torch.tensor([[t]]), cache))
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
    own = cfg.n_layer * cfg.n_head * policy.state_size(cfg.head_dim) * 4  # a rule's state: fp32 per query head
    assert cache1.nbytes == cfg.n_layer * 1 * cfg.n_kv_head * C * slot_bytes + own, "the same total as C in every layer"
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


# ---- the rules of the policies beyond the spec, on hand-made caches (one layer, a GQA group of 2) ----

def _one_step(policy, pos, score, keys=None, q=None):
    """A full cache of len(pos) slots, then one token (position 9) attends with query q (default 0: uniform
    attention). Returns the cached positions (slot order) and scores after the step."""
    C = len(pos)
    cache = KVCache(CFG, policy, 1, C)
    lc = cache.layers[0]
    lc.pos[0, 0] = torch.tensor(pos)
    lc.score[0, 0] = torch.tensor(score, dtype=torch.float32)
    if keys is not None:
        lc.k[0][0, 0] = torch.tensor(keys, dtype=torch.float32)
    q = torch.zeros(1, 2, 1, 4) if q is None else q
    lc.attend(q, torch.tensor([[[[0.0, 0.0, 0.0, 1.0]]]]), torch.randn(1, 1, 1, 4), torch.tensor([[9]]))
    return lc.pos[0, 0].tolist(), lc.score[0, 0].tolist()


def test_tova_replaces_scores_with_the_last_querys_attention():
    pos, score = _one_step(TOVA(keep=3), [2, 5, 7], [5.0, 1.0, 7.0])
    assert pos == [2, 9, 7]  # the lowest score (5: 1.0) went
    assert score == pytest.approx([2 / 3] * 3)  # uniform attention of 2 heads over 3 tokens, not added


def test_scissorhands_counts_the_important_queries_of_its_window():
    # Uniform attention makes every token important to every query: bits shift in as ones.
    seen = uniform_steps(Scissorhands(heavy=3, recent=1, window=2), 3, "step")
    assert seen[-1] == ([0, 1, 2], [3.0, 3.0, 1.0])  # 0b11, 0b11 (window 2 keeps two bits), 0b1
    # evict the token important least often outside the window (ties: the oldest)
    pol = Scissorhands(heavy=1, recent=2, window=3)
    assert pol.keep_score(torch.tensor([0b111, 0b001, 0b110, 0.0]), torch.tensor([1, 2, 3, 8]), torch.tensor(9)).tolist() \
        == [3.0, 1.0, 2.0, math.inf]
    pos, _ = _one_step(pol, [1, 2, 3], [0b111, 0b001, 0b110])
    assert pos == [1, 9, 3]
    with pytest.raises(UserError):
        Scissorhands(heavy=2, recent=2, window=25)  # the bits must fit fp32's 24-bit integers


def test_knorm_evicts_the_largest_key():
    keys = [[1.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 2.0, 0]]
    pos, score = _one_step(KNorm(keep=3), [0, 1, 2], [-1.0, -5.0, -2.0], keys)
    assert pos == [0, 9, 2] and score[1] == -1.0  # the new key (norm 1) entered with minus its norm


def test_keydiff_evicts_the_key_most_like_the_mean():
    keys = [[1.0, 0, 0, 0], [0, 1.0, 0, 0], [2.0, 0.1, 0, 0]]  # the anchor leans to the first direction
    pos, _ = _one_step(KeyDiff(keep=3), [0, 1, 2], [0.0] * 3, keys)
    assert pos == [0, 1, 9]  # slot 2 (cos 0.9995... with itself and slot 0 near the anchor) is the most typical
    pos, _ = _one_step(KeyDiff(keep=3), [0, 1, 2], [0.0] * 3, [[1.0, 0, 0, 0], [0, 1.0, 0, 0], [1.0, 0, 0, 0]])
    assert pos == [9, 1, 2]  # a tie between 0 and 2: the oldest goes


def test_snapkv_pools_the_observation_windows_attention():
    pol = SnapKV(heavy=4, window=2, kernel=3)
    assert pol.prompt_window == 2
    pooled = pol.prompt_score(torch.tensor([[[0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 1.0, 0.0]]]))
    assert pooled.tolist() == [[[0.0, 5.0, 5.0, 5.0, 0.0, 1.0, 1.0, 1.0]]]
    with pytest.raises(UserError):
        SnapKV(heavy=4, window=2, kernel=4)


def test_pyramidkv_shrinks_with_depth_and_keeps_the_total():
    pol = PyramidKV(heavy=100, window=32)
    caps = [pol.layer_capacity(i, 30, 4096) for i in range(30)]
    assert sum(caps) == 30 * pol.capacity  # the same memory as C in every layer
    assert caps == sorted(caps, reverse=True) and caps[0] == 32 + 195 and caps[-1] == 32 + 5
    assert [pol.layer_capacity(i, 30, 100) for i in (0, 29)] == [100, 100]  # C >= L: everything, every layer
    capped = [pol.layer_capacity(i, 30, 200) for i in range(30)]  # the bottom would exceed L: capped, total kept
    assert max(capped) == 200 and sum(capped) == 30 * 132


# ---- parameter combinations that contradict the rule, refused from the protocol ----

@pytest.fixture(scope="module")
def folder(byte_folder):
    return byte_folder("llama_gqa_tied")


@dataclass(frozen=True)
class _ProtectsAll(Policy):
    keep: int
    name = "protects_all"

    @property
    def capacity(self):
        return self.keep

    def keep_score(self, score, pos, t, keys=None, values=None, state=None):
        return torch.full_like(score, torch.inf)


def test_a_cache_whose_every_slot_is_protected_is_refused_where_it_first_evicts():
    rule = checked(_ProtectsAll)(keep=3)  # making it runs no hook (docs/spec.md): its first eviction is checked
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 8, 4, generator=g) for n in (2, 1, 1))
    for prefill in ("dense", "stream"):
        layer = KVCache(CFG, rule, batch=1, length=12, prefill=prefill).layers[0]
        with pytest.raises(PolicyFault, match="protects every one of the 3 slots of a full cache"):
            layer.attend(q, k, v, torch.arange(8)[None])
    for name, cls in REGISTRY.items():  # every registered policy's own default split is fine at any C
        if cls.takes_budget:
            for C in (1, 2, 5, 64):
                make_policy(name, C, 1000)


def test_sinks_with_no_recent_share_is_refused_on_the_cli(folder, capsys, monkeypatch):
    result = run_cli(capsys, monkeypatch, "generate", "--model", folder, "--policy", "sinks", "--budget", 4,
                     "--recent", 0, "hi")
    one_line_error(result, "every one of its 4 slots is protected")


def test_a_budget_that_rounds_to_one_token_says_so(folder, capsys, monkeypatch):
    code, _, err = run_cli(capsys, monkeypatch, "eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 20,
                           "--policy", "h2o", "--budget", "1e-7")
    assert code == 0 and "rounds to less than one token: C = 1" in err
