"""The hindsight reference (policies/hindsight.py, evals/hindsight.py): its choices against a plain-Python replay
of its rule on the full pass's attention; its masked evaluation against the real cache making the same choices;
the refusals of every command that cannot read the text ahead."""
from dataclasses import dataclass

import pytest
import torch

from h2o_mini.cache import KVCache
from h2o_mini.evals.hindsight import hindsight_logits, leave_times
from h2o_mini.evals.ppl import score_text
from h2o_mini.model import causal_attention
from h2o_mini.policies import Policy, make_policy

from .conftest import FAMILIES, GPL3, text_bytes
from .test_bad_input import one_line_error, run_cli

T, C = 40, 9
IDS = text_bytes(T, offset=3000)


class _Recording:
    """A 'cache' that attends with the full cache and keeps each layer's q and k (the naive replay reads them)."""

    def __init__(self, cfg):
        self.layers = [self._Layer(cfg, i) for i in range(cfg.n_layer)]

    class _Layer:
        def __init__(self, cfg, i):
            self.cfg, self.window = cfg, cfg.window(i)

        def attend(self, q, k, v, pos):
            self.q, self.k = q[0], k[0]
            return causal_attention(q, k, v, pos, self.window, self.cfg.attn_scale, self.cfg.attn_softcap)


def naive_leave(cfg, layer, capacity: int, recent: int) -> list[list[int]]:
    """The rule restated: A[q][j] summed over the group's query heads, one softmax at a time; then, token by
    token, a full cache evicts the oldest dead token (sliding layers), else the lowest sum of A[q][j] over
    q >= t outside the recent window (ties: the oldest)."""
    H, g, W = layer.k.shape[0], layer.q.shape[0] // layer.k.shape[0], layer.window
    out = []
    for h in range(H):
        A = [[0.0] * T for _ in range(T)]
        for qh in range(h * g, h * g + g):
            for q in range(T):
                seen = [j for j in range(q + 1) if W is None or q - j < W]
                logits = torch.stack([(layer.q[qh, q] @ layer.k[h, j]).float() * cfg.attn_scale for j in seen])
                if cfg.attn_softcap:
                    logits = cfg.attn_softcap * torch.tanh(logits / cfg.attn_softcap)
                for j, p in zip(seen, logits.softmax(0).tolist()):
                    A[q][j] += p
        leave, cached = [T] * T, []
        for t in range(T):
            if len(cached) == capacity:
                dead = [j for j in cached if W is not None and j <= t - W]
                if dead:
                    victim = min(dead)
                else:
                    future = {j: sum(A[q][j] for q in range(t, T)) for j in cached if j <= t - recent}
                    victim = min(future, key=lambda j: (future[j], j))
                cached.remove(victim)
                leave[victim] = t
            cached.append(t)
        out.append(leave)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_choices_equal_a_plain_replay_of_the_rule(tiny_model, family):
    model = tiny_model(family)
    policy = make_policy("hindsight", C, T, 3)
    got = leave_times(model, IDS, policy)
    rec = _Recording(model.cfg)
    with torch.no_grad():
        model(torch.tensor([IDS]), torch.arange(T)[None], rec)
    evicted = 0
    for i, layer in enumerate(rec.layers):
        capacity = min(C, layer.window or T)
        want = naive_leave(model.cfg, layer, capacity, policy.recent)
        assert got[i].tolist() == want, (family, i)
        evicted += sum(v < T for row in want for v in row)
    assert evicted > 0


@dataclass(frozen=True)
class Scheduled(Policy):
    """Test-only: evicts what a given schedule says (keep-score = the arrival at which a token is to leave)."""

    slots: int
    layer: int = 0
    name = "scheduled"

    @property
    def capacity(self) -> int:
        return self.slots

    def for_layer(self, layer, n_layer):
        copy = Scheduled(self.slots, layer)
        object.__setattr__(copy, "leave", self.leave)  # the schedule: per layer, (H, T)
        return copy

    def keep_score(self, score, pos, t, keys=None, values=None, state=None):
        if not hasattr(self, "leave"):  # the protocol's own check when the policy is made: nothing protected
            return score
        return self.leave[self.layer][None].gather(2, pos.clamp(min=0)).float()  # (1, H, S)


@pytest.mark.parametrize("family", FAMILIES)
def test_masked_evaluation_equals_the_cache_making_the_same_choices(tiny_model, family):
    """The evaluated pass (a mask over every key and value) gives the logits of the real cache, in stream mode,
    when that cache evicts exactly the tokens hindsight chose."""
    model = tiny_model(family)
    policy = make_policy("hindsight", C, T, 3)
    scheduled = Scheduled(C)
    object.__setattr__(scheduled, "leave", leave_times(model, IDS, policy))
    cache = KVCache(model.cfg, scheduled, 1, T, prefill="stream")
    x = torch.tensor([IDS])
    with torch.no_grad():
        want = torch.cat([model(x[:, s:s + 16], torch.arange(s, min(T, s + 16))[None], cache)
                          for s in range(0, T, 16)], 1)
        got = torch.cat([logits for _, logits in hindsight_logits(model, IDS, policy, chunk=16)], 1)
        full = model(x, torch.arange(T)[None])
    assert (got - want).abs().max().item() <= 1e-4
    assert (got - full).abs().max().item() > 1e-3  # something was evicted, and it shows


def test_no_eviction_is_full_and_eviction_costs(tiny_model):
    model = tiny_model("llama_gqa_tied")
    ids = text_bytes(200, offset=500)
    full = score_text(model, ids, make_policy("full", None, 200), progress=False)
    whole = score_text(model, ids, make_policy("hindsight", 200, 200), progress=False)
    assert abs(whole["nll"] - full["nll"]) <= 1e-5
    small = score_text(model, ids, make_policy("hindsight", 0.1, 200), compare_full=True, progress=False)
    assert small["policy"] == "hindsight" and small["capacity"] == 20 and small["top1_agree_full"] < 1
    assert small["kv_bytes"] == score_text(model, ids, make_policy("h2o", 0.1, 200), progress=False)["kv_bytes"]


@pytest.fixture(scope="module")
def folder(llama_bytes):
    return llama_bytes


def test_eval_ppl_runs_it_and_every_causal_command_refuses_it(folder, capsys, monkeypatch, tmp_path):
    code, out, err = run_cli(capsys, monkeypatch, "eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 64,
                             "--policy", "hindsight", "--budget", 16, "--json")
    assert code == 0, err
    assert '"policy": "hindsight"' in out
    ahead = "reads the text ahead"
    for command, args in ((["generate"], ["--no-chat", "--max-new-tokens", 4, "Hello"]),
                          (["bench"], ["--prompt-tokens", 32, "--new-tokens", 2]),
                          (["eval", "needle"], ["--lengths", 400, "--depths", 0.5]),
                          (["eval", "tasks"], ["--tasks", "gpl_next_sentence", "--limit", 1]),
                          (["explore"], ["--tokens", 32, "--out", tmp_path / "x.html"]),
                          (["plot", "kept"], ["--tokens", 32, "--out", tmp_path / "x.png"])):
        one_line_error(run_cli(capsys, monkeypatch, *command, "--model", folder, *args, "--policy", "hindsight",
                               "--budget", 16), ahead)
    one_line_error(run_cli(capsys, monkeypatch, "check-policy", "hindsight"), ahead)
    one_line_error(run_cli(capsys, monkeypatch, "eval", "ppl", "--model", folder, "--text", GPL3, "--tokens", 64,
                           "--policy", "hindsight", "--budget", 16, "--kv-bits", 8), "--kv-bits")


def test_sweep_table_reads_policies_against_h2o_full_and_hindsight(folder, capsys, monkeypatch):
    code, out, err = run_cli(capsys, monkeypatch, "eval", "sweep", "ppl", "--model", folder, "--text", GPL3,
                             "--tokens", 64, "--policy", "local", "--policy", "h2o", "--policy", "hindsight",
                             "--budget", 16)
    assert code == 0, err
    lines = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    full, local, h2o, hindsight = (float(lines[p][2]) for p in ("full", "local", "h2o", "hindsight"))
    assert lines["h2o"][3:] == ["+0%", "+0%"] and lines["hindsight"][4] == "+100%"
    assert lines["local"][3] == f"{(h2o - local) / (h2o - full):+.0%}"
    assert lines["local"][4] == f"{(h2o - local) / (h2o - hindsight):+.0%}"
